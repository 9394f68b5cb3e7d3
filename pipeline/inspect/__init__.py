"""Questions asked of a config without training on it: `stats.py` (`tokenmill stats`: the
corpus's documents and lengths) and `provenance.py` (`tokenmill trace`: the documents behind
a step's rows).
"""
