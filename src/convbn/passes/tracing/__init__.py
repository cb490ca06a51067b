"""Tracing a user's model into an ``fx.Graph`` with convbn's leaf policy (above ``bn/``: it inlines recognised BatchNorms)."""
