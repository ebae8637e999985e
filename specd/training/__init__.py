"""Offline training of learned components (the SpecDec++ acceptance head, `specd train-head`)."""
