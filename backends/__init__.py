"""Backends: serialize plans (planfile), predict their time (cost), report
on them (stats, explain, viz). Lowering to programs is the ``emit`` pass
(:mod:`attnplan.passes.emit`)."""
