# Stubs for scikit-learn 1.9.1: only the names that eqxctx.demo uses.
