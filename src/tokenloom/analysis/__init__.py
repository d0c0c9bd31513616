"""The ledger read offline: `tokenloom explain` reads a trace the ledger wrote (`metrics/trace.py`)
and says where the run's time went (`explain.py`), optionally as a figure (`plot.py`, matplotlib).

Nothing on the serving path imports this package: `metrics/` collects while serving and stays
free of the analysis and of matplotlib; only the command line sits above it.
"""
