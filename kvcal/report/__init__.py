"""Reporting: load run directories, choose metrics, paired statistics, verdicts and the gate, Markdown/HTML.

Never loads a model: everything here reads what `kvcal eval` wrote.
"""
