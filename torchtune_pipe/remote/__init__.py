"""Remote stages: map stages on Ray actors (all of a stage's workers, or some of them) and
what they report."""
