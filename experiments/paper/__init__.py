"""The paper's experiments (Pan et al., ICML 2022) with tnspec layers, at laptop scale:
Proposition 2's scales (``prop2``), propagation through Linear-5 and Odd-5 (``propagation``),
random Conv-4 formats (``random_formats``), tensorial All-Conv nets without batch norm
(``allconv``), and an audit of another library's init (``audit``)."""
