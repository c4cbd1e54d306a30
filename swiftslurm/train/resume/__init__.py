"""Where a run starts: the resume agreement, train.resume_from, weights-only loads, another world size."""
