package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
	"time"
	"unicode/utf8"
)

// WriteJSON writes the report as one indented JSON document.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("write the report: %w", err)
	}
	return nil
}

// WriteTable writes the report as a table for people: each section's figures with their
// median and, over several rounds, each round's value.
func (r *Report) WriteTable(w io.Writer) error {
	rounds := r.Config.Rounds
	b := &strings.Builder{}
	fmt.Fprintf(b, "baton bench relay: %s rows, %d round(s); %d CPUs, PostgreSQL %s, nats-server %s; wall time %s\n",
		thousands(float64(r.Config.Rows)), rounds, r.Environment.CPUs, r.Environment.PostgresVersion,
		r.Environment.NATSVersion, (time.Duration(r.WallSeconds) * time.Second).String())
	// Cells of every row first, to size the columns over the whole table.
	type row struct {
		title string   // a section's title line, or empty
		cells []string // label, unit, median, rounds…
	}
	var rows []row
	section := ""
	for _, key := range r.Keys() {
		if s := key[:strings.IndexByte(key, '.')]; s != section {
			section = s
			head := []string{"", "", "median"}
			if rounds == 1 {
				head[2] = ""
			}
			for i := range rounds {
				if rounds > 1 {
					head = append(head, fmt.Sprintf("round %d", i+1))
				}
			}
			rows = append(rows, row{title: r.sectionTitle(s)}, row{cells: head})
		}
		f := r.Figures[key]
		cells := []string{f.Label, f.Unit, format(float64(f.Median), f.Unit)}
		if rounds > 1 {
			for _, v := range f.Rounds {
				cells = append(cells, format(float64(v), f.Unit))
			}
		}
		rows = append(rows, row{cells: cells})
	}
	var width []int
	for _, rw := range rows {
		for i, c := range rw.cells {
			if i >= len(width) {
				width = append(width, 0)
			}
			width[i] = max(width[i], utf8.RuneCountInString(c))
		}
	}
	for _, rw := range rows {
		if rw.title != "" {
			fmt.Fprintf(b, "\n%s\n", rw.title)
			continue
		}
		line := "  " + pad(rw.cells[0], width[0], false) + "  " + pad(rw.cells[1], width[1], false)
		for i, c := range rw.cells[2:] {
			line += "  " + pad(c, width[i+2], true)
		}
		b.WriteString(strings.TrimRight(line, " ") + "\n")
	}
	var notes []string
	if !r.Environment.WalsenderMeasured {
		notes = append(notes, "walsender CPU not measured: PostgreSQL is not on this machine")
	}
	if !r.Environment.NATSInProcess {
		notes = append(notes, "NATS CPU not measured: the NATS server is not in this process")
	}
	if r.Profile != "" {
		notes = append(notes, fmt.Sprintf("CPU profile of baton relay's catch-up: %s\n  read it with: go tool pprof -top %s", r.Profile, r.Profile))
	}
	for _, n := range notes {
		fmt.Fprintf(b, "\n%s\n", n)
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write the report: %w", err)
	}
	return nil
}

// pad pads s with spaces to width runes, on the left when right-aligned.
func pad(s string, width int, right bool) string {
	fill := strings.Repeat(" ", max(0, width-utf8.RuneCountInString(s)))
	if right {
		return fill + s
	}
	return s + fill
}

// sectionTitle says what a figure key's section measured.
func (r *Report) sectionTitle(section string) string {
	var rowsPerTx, convs, rate int
	switch {
	case section == "backfill":
		return fmt.Sprintf("first start of baton relay on %s pending rows (no slot yet)", thousands(float64(r.Config.Rows)))
	case scan(section, "tx%d_conv%d", &rowsPerTx, &convs):
		return backlogTitle(r.Config.Rows, rowsPerTx, convs)
	case scan(section, "latency_%d", &rate):
		return fmt.Sprintf("commit → stored at %s commits/s (%d producers, %v each after a %v warm-up)", thousands(float64(rate)),
			producers, time.Duration(r.Config.LatencyDurationSeconds*float64(time.Second)), time.Duration(r.Config.WarmupSeconds*float64(time.Second)))
	}
	return section
}

// scan reports whether s is exactly format filled with integers.
func scan(s, format string, args ...any) bool {
	n, err := fmt.Sscanf(s, format, args...)
	if err != nil || n != len(args) {
		return false
	}
	back := make([]any, len(args))
	for i, a := range args {
		back[i] = *(a.(*int))
	}
	return fmt.Sprintf(format, back...) == s
}

// format writes v for its unit.
func format(v float64, unit string) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	switch unit {
	case "rows/s", "msgs/s", "commits/s":
		return thousands(v)
	case "x", "share":
		return fmt.Sprintf("%.2f", v)
	case "MiB":
		return fmt.Sprintf("%.1f", v)
	case "ms":
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.2f", v)
}
