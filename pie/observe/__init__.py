"""What the engine tells its operators about itself: metrics, probes and traces."""
