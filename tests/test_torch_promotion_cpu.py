"""cupylab._promotion's torch rule checked against torch itself (wherever torch is installed):
the default dtype, refusals for ``dtype=`` and scalars, 0-d tensors taken by category, and
subclasses of Python numbers as strong scalars."""
import pytest

torch = pytest.importorskip("torch")


# -- the torch promotion rule (cupylab._promotion) against torch itself ----------------------
def _tkey(name, zero_d=False):
    return ("a", name, zero_d)


def test_torch_rule_follows_the_default_dtype_without_stale_answers():
    from cupylab import _promotion as P

    ints = (_tkey("int32"), _tkey("int32"))
    old = torch.get_default_dtype()
    try:
        for dd in (torch.float64, torch.float32, torch.float64):
            torch.set_default_dtype(dd)
            want = str(dd).split(".")[1]
            assert P.resolve("torch", "true_divide", ints)[1].name == want
            assert P.resolve("torch", "add", (_tkey("int32"), ("w", "float")))[1].name == want
    finally:
        torch.set_default_dtype(old)


def test_torch_rule_refusals_hold_for_dtype_and_scalars():
    from cupylab import _dtypes, _promotion as P

    ints = (_tkey("int32"), _tkey("int32"))
    i32 = _dtypes.from_name("int32")
    with pytest.raises(TypeError, match="true division cannot compute in int32"):
        P.resolve("torch", "true_divide", ints, dtype=i32)
    with pytest.raises(TypeError, match="floor_divide is not supported for complex64"):
        P.resolve("torch", "floor_divide", (_tkey("float32"),) * 2,
                  dtype=_dtypes.from_name("complex64"))
    with pytest.raises(TypeError, match="Subtraction"):
        P.resolve("torch", "subtract", ints, dtype=_dtypes.from_name("bool"), casting="unsafe")
    with pytest.raises(TypeError, match="Subtraction"):
        P.resolve("torch", "subtract", (_tkey("int64"), ("w", "bool")))
    with pytest.raises(TypeError, match="scalar of kind float to int32"):
        P.resolve("torch", "add", (_tkey("int32"), ("w", "float")), dtype=i32)
    with pytest.raises(TypeError, match="scalar of kind float64 to int32"):  # a 0-d tensor
        P.resolve("torch", "add", (_tkey("int32"), _tkey("float64", True)), dtype=i32)
    assert P.resolve("torch", "add", (_tkey("int32"), ("w", "float")), dtype=i32,
                     casting="unsafe")[0] is i32
    with pytest.raises(TypeError, match="complex32"):
        P.resolve("torch", "add", (_tkey("float16"), ("w", "complex")))


def test_torch_rule_takes_0d_tensors_by_category():
    """img + torch.tensor(3): torch keeps uint8 (a 0-d int64 tensor counts like a Python
    int); the input-cast check must not refuse the 0-d operand."""
    from cupylab import _promotion as P

    got = P.resolve("torch", "add", (_tkey("uint8"), _tkey("int64", True)))[1].name
    want = torch.result_type(torch.ones(2, dtype=torch.uint8), torch.tensor(3))
    assert got == str(want).split(".")[1] == "uint8"


def test_subclasses_of_python_numbers_are_strong_scalars():
    import enum
    import fractions

    from cupylab import _promotion as P

    class Level(enum.IntEnum):
        HIGH = 3

    class Meters(float):
        pass

    assert P.operand_key(Level.HIGH, None) == ("s", "int64")
    assert P.operand_key(Meters(2.5), None) == ("s", "float64")
    assert P.operand_key(2.5, None) == ("w", "float")
    with pytest.raises(TypeError, match="Fraction is not a number cupylab can use"):
        P.operand_key(fractions.Fraction(1, 3), None)


def test_fused_add_mul_of_two_0d_tensors_follows_torch():
    """(a + b) of two 0-d tensors is 0-d: against a dimensioned s it counts by category only
    (float64 0-d + 0-d, times float32 s, is float32 in torch; cupylab said float64)."""
    from cupylab import _promotion as P

    for a, b, s in (("float64", "float64", "float32"), ("float64", "float16", "bfloat16"),
                    ("int64", "int64", "int8"), ("float64", "float32", "float16")):
        ta = torch.ones((), dtype=getattr(torch, a))
        tb = torch.ones((), dtype=getattr(torch, b))
        ts = torch.ones(3, dtype=getattr(torch, s))
        want = ((ta + tb) * ts).dtype
        got = P.resolve("torch", "fused_add_mul", (_tkey(a, True), _tkey(b, True), _tkey(s)))[1]
        assert got.name == str(want).split(".")[1], (a, b, s)
    # one dimensioned operand: (a + b) is dimensioned and promotes s as a tensor
    got = P.resolve("torch", "fused_add_mul", (_tkey("float64"), _tkey("float64", True),
                                               _tkey("float32")))[1]
    assert got.name == "float64"
