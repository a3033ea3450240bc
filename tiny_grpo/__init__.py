"""The plumbing every experiment_*/train.py shares, written once: what a run only needs in order to run.
None of it changes the algorithm; each module is one concern, and knows no experiment but through its arguments."""
