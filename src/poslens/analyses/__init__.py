"""Analyses built on the engine and the stack: averaged scores, intermediates, map metrics, comparisons."""
