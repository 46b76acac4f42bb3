"""OPT model math and parameter trees."""
