"""The base of every error a user can fix (bad input, missing files, unknown voice).

The CLI prints these as one line and the server maps them to error codes; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class VoiceOutError(Exception):
    """An error whose message tells the user what is wrong and how to fix it."""
