"""The thin command line: every command calls a library function and only formats its result."""
