// Package repocheck holds tests that read the repository's own source for patterns no test
// run can catch reliably: a race that fails one run in a thousand is found by reading the
// code that makes it possible.
package repocheck
