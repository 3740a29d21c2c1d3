"""nanoengine: a small, fast, readable LLM inference engine (the book's finished package)."""

__version__ = "0.1.0"
