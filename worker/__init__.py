"""The inference engine and the worker server: one process is one instance."""
