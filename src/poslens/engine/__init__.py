"""Models, text, hook points and statistics: everything that runs a real model (the engine)."""
