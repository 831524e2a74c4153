"""Small trainable reproductions of the papers' experiments (imports the library, never imported by it)."""
