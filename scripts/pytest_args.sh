# Sourced by the gpu_check scripts: the extra pytest arguments of $PYTEST_ARGS as the array
# PARGS, split with shell quoting (Python's shlex), so that PYTEST_ARGS="-m 'not slow'" passes
# one marker expression. An unquoted ${PYTEST_ARGS} would pass "'not" and "slow'" as two words,
# and pytest would then select nothing. Exits 2 on unbalanced quotes.
PARGS=()
if [ -n "${PYTEST_ARGS:-}" ]; then
    if ! _pargs=$(${PY:-python3} -c \
            'import os, shlex; print(*shlex.split(os.environ["PYTEST_ARGS"]), sep="\n")'); then
        echo "PYTEST_ARGS: cannot split $PYTEST_ARGS (unbalanced quotes?)" >&2
        exit 2
    fi
    [ -n "$_pargs" ] && mapfile -t PARGS <<<"$_pargs"
    unset _pargs
fi
