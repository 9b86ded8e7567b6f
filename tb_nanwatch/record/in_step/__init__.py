"""Inside the compiled step: the statistics, the taps and the step's own record (what runs each training step)."""
