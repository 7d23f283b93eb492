"""The testing kit: code the test suite and the benchmarks (bench/) share, shipped with the product so that
neither imports the other's files."""
