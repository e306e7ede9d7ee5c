"""Lightning callbacks of lightning_troll (installed as ``lightning_troll.callbacks``)."""
