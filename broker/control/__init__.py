"""The broker's pure control: a function of its inputs, no Ray, hardware or clock."""
