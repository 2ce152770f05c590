"""Test helpers shared by several test files (no tests here)."""
