"""`python -m autotune`: the CLI without the console script (tests, clusters)."""

from autotune.cli import app

if __name__ == "__main__":
    app()
