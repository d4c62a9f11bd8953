"""Database dialects: each holds all of one database's SQL (in ``.sql`` files) and its driver."""
