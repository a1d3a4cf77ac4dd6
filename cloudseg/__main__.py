"""`python -m cloudseg` (and `torchrun -m cloudseg`) runs the command line."""

from cloudseg.cli import entry

if __name__ == "__main__":  # not again in a process that imports it (multiprocessing's spawn)
    entry()
