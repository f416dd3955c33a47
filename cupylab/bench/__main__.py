"""``python -m cupylab.bench`` is ``cupylab-bench``."""
from .cli import main

if __name__ == "__main__":
    main()
