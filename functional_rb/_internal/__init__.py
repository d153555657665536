"""Leaf helpers of the core: errors, checks, eager calls, layout, random words, trees."""
