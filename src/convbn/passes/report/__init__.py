"""What the passes report: one ``BNOutcome`` per BatchNorm, and the convert / fold reports built from it."""
