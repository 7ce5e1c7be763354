"""The `baton` command (cli/main.py), above every other package: it may import cluster and bench; none of
them imports it."""
