"""After an incident: bundles, rewind points, replay, remedy trials and recovery."""
