package bench

import (
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// ReportVersion is the version of the JSON document's layout: it changes when a field is
// renamed or removed, not when one is added.
const ReportVersion = 1

// Value is a measured number; NaN (not measured) is null in JSON.
type Value float64

// MarshalJSON writes v, or null when it is NaN or infinite.
func (v Value) MarshalJSON() ([]byte, error) {
	f := float64(v)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return []byte("null"), nil
	}
	return strconv.AppendFloat(nil, f, 'g', 6, 64), nil
}

// UnmarshalJSON reads a number, or null as NaN.
func (v *Value) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*v = Value(math.NaN())
		return nil
	}
	var f float64
	if err := json.Unmarshal(b, &f); err != nil {
		return err
	}
	*v = Value(f)
	return nil
}

// Figure is one measured quantity: its value in each round, and their median.
type Figure struct {
	// Label says what it is, for people.
	Label string `json:"label"`
	// Unit is rows/s, msgs/s, s, ms, us/row, MiB, x (a ratio) or share (0…1).
	Unit string `json:"unit"`
	// Median is the median of Rounds' measured values (the mean of the middle two for an
	// even count), null when no round measured it.
	Median Value `json:"median"`
	// Rounds holds the value of each round, null where a round did not measure it.
	Rounds []Value `json:"rounds"`
}

// Report is what a run measured. Its JSON form is documented in the package doc.
type Report struct {
	Version     int               `json:"version"`
	StartedAt   time.Time         `json:"started_at"`
	WallSeconds float64           `json:"wall_seconds"`
	Config      ReportConfig      `json:"config"`
	Environment Environment       `json:"environment"`
	Figures     map[string]Figure `json:"figures"`
	// Profile is the path of the relay's CPU profile, when one was taken.
	Profile string `json:"profile,omitempty"`

	order   []string                   // figure keys in the order first recorded
	samples map[string][]time.Duration // latency samples by "<rate>/<contender>", for the plot
}

// ReportConfig is the run's configuration.
type ReportConfig struct {
	Rows                   int      `json:"rows"`
	Rounds                 int      `json:"rounds"`
	Rates                  []int    `json:"rates"`
	LatencyDurationSeconds float64  `json:"latency_duration_seconds"`
	WarmupSeconds          float64  `json:"warmup_seconds"`
	Parts                  []string `json:"parts"`
	// Shards is how many shard relays ran at once in the catch-ups; 0 (omitted): none.
	Shards int `json:"shards,omitempty"`
}

// Environment is what the run ran on.
type Environment struct {
	CPUs              int    `json:"cpus"`
	GoVersion         string `json:"go_version"`
	PostgresVersion   string `json:"postgres_version"`
	NATSVersion       string `json:"nats_version"`
	NATSInProcess     bool   `json:"nats_in_process"`
	WalsenderMeasured bool   `json:"walsender_measured"`
}

func newReport(cfg *Config) *Report {
	return &Report{
		Version:   ReportVersion,
		StartedAt: time.Now().UTC().Truncate(time.Second),
		Config: ReportConfig{Rows: cfg.Rows, Rounds: cfg.Rounds, Rates: cfg.Rates,
			LatencyDurationSeconds: cfg.LatencyDuration.Seconds(), WarmupSeconds: warmup.Seconds(), Parts: cfg.Parts,
			Shards: cfg.Shards},
		Figures: map[string]Figure{},
		samples: map[string][]time.Duration{},
	}
}

// set records round's value of figure key.
func (r *Report) set(round int, key, label, unit string, v float64) {
	f, ok := r.Figures[key]
	if !ok {
		f = Figure{Label: label, Unit: unit, Rounds: make([]Value, r.Config.Rounds)}
		for i := range f.Rounds {
			f.Rounds[i] = Value(math.NaN())
		}
		r.order = append(r.order, key)
	}
	f.Rounds[round] = Value(v)
	f.Median = Value(median(f.Rounds))
	r.Figures[key] = f
}

// get returns round's value of figure key, NaN when missing.
func (r *Report) get(round int, key string) float64 {
	f, ok := r.Figures[key]
	if !ok {
		return math.NaN()
	}
	return float64(f.Rounds[round])
}

// Keys returns the figure keys in the table's order: sections as sectionRank orders them,
// figures within a section in the order they were first measured.
func (r *Report) Keys() []string {
	keys := slices.Clone(r.order)
	if len(keys) == 0 { // a report read back from JSON
		for k := range r.Figures {
			keys = append(keys, k)
		}
		slices.Sort(keys)
	}
	slices.SortStableFunc(keys, func(a, b string) int { return sectionRank(a) - sectionRank(b) })
	return keys
}

// sectionRank orders the sections of the table: the 1,000-conversation backlogs, the hot
// ones, the backfill, then latency by rate.
func sectionRank(key string) int {
	section, _, _ := strings.Cut(key, ".")
	var rowsPerTx, convs, rate int
	switch {
	case scan(section, "tx%d_conv%d", &rowsPerTx, &convs):
		return 1_000_000 - convs*1000 + rowsPerTx // more conversations first, then fewer rows per tx
	case section == "backfill":
		return 2_000_000
	case scan(section, "latency_%d", &rate):
		return 3_000_000 + rate
	}
	return 4_000_000
}

// median returns the median of the values that are numbers, NaN when none is.
func median(vs []Value) float64 {
	var xs []float64
	for _, v := range vs {
		if f := float64(v); !math.IsNaN(f) && !math.IsInf(f, 0) {
			xs = append(xs, f)
		}
	}
	if len(xs) == 0 {
		return math.NaN()
	}
	slices.Sort(xs)
	m := len(xs) / 2
	if len(xs)%2 == 1 {
		return xs[m]
	}
	return (xs[m-1] + xs[m]) / 2
}

// ratio returns a / b, NaN when either is not a positive number.
func ratio(a, b float64) float64 {
	if !(a > 0) || !(b > 0) || math.IsInf(a, 0) || math.IsInf(b, 0) {
		return math.NaN()
	}
	return a / b
}
