"""Writing the record: the journal, event files, run directories and crash safety (no TensorFlow import here)."""
