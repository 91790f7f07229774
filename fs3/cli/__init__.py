"""The ``fs3`` command."""
