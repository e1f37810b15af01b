"""The refusals of a refresh that the learner's push acts on, by their text (a refusal crosses Ray as a message).

Kept apart from the weight code so that the router, which answers with them, imports no torch (~1.5 s of CPU and
~180 MB resident in each router process)."""

NO_BASE = "the delta's base is missing"  # in a refusal that makes the learner push dense instead
REGROUP = "weight group out of date"  # the router's answer when membership changed: the learner forms it again
