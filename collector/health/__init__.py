"""Rank health: the evaluator loop that marks ranks slow, hung or dead from their steps
and heartbeats, and names a hang's culprit.

May import ``collector.read`` and below; a sibling of alerting, actions and incidents.
"""
