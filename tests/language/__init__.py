"""Tests of the language stage: parsing, checking, and a fuzzer of the front end."""
