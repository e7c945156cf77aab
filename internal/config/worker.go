package config

import "time"

// Worker defaults: the value a worker (package consumer) takes for each setting left zero.
// Package consumer exports each one as consumer.Default<Setting> (DefaultWorkerLease is
// consumer.DefaultLease) and fills its Config from them, so a command that configures workers
// and the library itself cannot disagree.
const (
	DefaultWorkerDurable            = "baton-workers"
	DefaultWorkerDebounce           = 5 * time.Millisecond
	DefaultWorkerLease              = 30 * time.Second
	DefaultWorkerMaxAttempts        = 3
	DefaultWorkerBackoffBase        = time.Second
	DefaultWorkerBackoffMax         = time.Minute
	DefaultWorkerMaxConcurrentTurns = 128
	DefaultWorkerPollInterval       = 250 * time.Millisecond
	DefaultWorkerSweepInterval      = 15 * time.Second
	DefaultWorkerRecoveryInterval   = 5 * time.Second
	DefaultWorkerAckWait            = 30 * time.Second
	DefaultWorkerMaxAckPending      = 20000
	DefaultWorkerShutdownGrace      = 10 * time.Second
	DefaultWorkerMaxTurnMessages    = 100
	DefaultWorkerMaxTurnBytes       = 8 << 20
)
