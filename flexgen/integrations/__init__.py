"""Adapters that plug flexgen into other libraries; each imports its library only when used."""
