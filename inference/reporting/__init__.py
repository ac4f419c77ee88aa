"""The admin's usage report: its page, filter form and server-drawn charts, over ``inference.usage.reports``."""
