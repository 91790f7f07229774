"""Tools for tests that need more than the code under test: a disk that loses unsynced data."""
