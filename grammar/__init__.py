"""The Lark grammar of tnspec, installed as the package data ``tnspec.grammar``."""
