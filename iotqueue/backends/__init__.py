"""Database backends of the project (Django's ENGINE setting names them)."""
