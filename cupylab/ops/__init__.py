"""cupylab's operators, one module per family."""
