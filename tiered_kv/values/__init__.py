"""Values: the plain data every layer shares (keys, block layouts, record headers, sizes, jobs).

Nothing here does I/O, starts a thread or imports torch; every other layer may import it.

Threading contract: immutable values and pure functions, safe from any thread.
"""
