"""The algorithm, engine-free: Jacobi window, n-gram pool, lookups, shared memory, trees."""
