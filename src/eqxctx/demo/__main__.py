"""`python -m eqxctx.demo`: see `eqxctx.demo`."""

from eqxctx.demo._cli import main


if __name__ == "__main__":
    raise SystemExit(main())
