"""Everything that runs in the server: API servicers, repository, scheduling, workers, backend."""
