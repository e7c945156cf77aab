package consumer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// opEnd is how a tool call ended, kept by its Turn until the turn's next statement writes it
// (recordOperationSQL, finishSQL, or endOperationsSQL).
type opEnd struct {
	id      int64
	status  string // done or error
	output  []byte // JSON; nil for none
	errText string
	took    time.Duration // from just before the call was recorded to its end
}

// opEnds are the columns of ends, as recordOperationSQL, finishSQL and endOperationsSQL take
// them.
func opEnds(ends []opEnd) (ids []int64, statuses []string, outputs, errs []*string, tookUS []int64) {
	ids, statuses = make([]int64, len(ends)), make([]string, len(ends))
	outputs, errs, tookUS = make([]*string, len(ends)), make([]*string, len(ends)), make([]int64, len(ends))
	for i, e := range ends {
		ids[i], statuses[i], tookUS[i] = e.id, e.status, e.took.Microseconds()
		if e.output != nil {
			out := string(e.output)
			outputs[i] = &out
		}
		if e.errText != "" {
			errText := e.errText
			errs[i] = &errText
		}
	}
	return ids, statuses, outputs, errs, tookUS
}

// recordReq is a tool call to record for a run (see recordOperationSQL), with ends, the ends
// of the run's earlier calls not written yet.
type recordReq struct {
	runID, conversationID string
	ids                   []int64 // the run's claimed rows
	tool                  string
	effect                Effect
	input                 []byte
	ends                  []opEnd
}

// recorded is the answer to a recordReq: the operation's id, or why it was not recorded
// (errLeaseLost: the run no longer holds its turn).
type recorded struct {
	id  int64
	err error
}

// recordOperation records a tool call as running and returns its id, or errLeaseLost when the
// run no longer holds its turn. It writes r.ends in the same transaction; they are written
// unless it returns another error.
//
// When Postgres refuses a value of an end it carries (see refused), the ends are written on
// their own (endOperations: each refused output is left out and said so) and the call is
// recorded again without them, so that one call's output never fails the turn's next calls.
func (s *store) recordOperation(ctx context.Context, r recordReq) (int64, error) {
	id, err := s.recordOnce(ctx, r)
	if len(r.ends) > 0 && refused(err) {
		if eerr := s.endOperations(ctx, r.ends); eerr != nil {
			return 0, fmt.Errorf("record operation: %w; then, the ends it carried on their own: %w", err, eerr)
		}
		r.ends = nil
		if id, err = s.recordOnce(ctx, r); err != nil {
			err = endsWrittenError{err}
		}
	}
	return id, err
}

// endsWrittenError is a record's error after the ends the record carried were written on
// their own: the caller need not carry them again.
type endsWrittenError struct{ error }

func (e endsWrittenError) Unwrap() error { return e.error }

// recordOnce is recordOperation's statement: the ends r carries, then the call's record.
func (s *store) recordOnce(ctx context.Context, r recordReq) (int64, error) {
	var id int64
	batch := &pgx.Batch{}
	// Also for a turn's first call, which carries no ends: the record locks the run's rows,
	// and lock_timeout bounds how long a row another transaction holds stalls it (and the
	// records runner, every turn's tool calls, behind it).
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	if len(r.ends) > 0 {
		endIDs, statuses, outputs, errs, took := opEnds(r.ends)
		batch.Queue(endOperationsSQL, endIDs, statuses, outputs, errs, took)
	}
	batch.Queue(recordOperationSQL, r.runID, r.conversationID, r.tool, string(r.effect), r.input, r.ids).QueryRow(func(row pgx.Row) error {
		return row.Scan(&id)
	})
	err := s.pool.SendBatch(ctx, batch).Close()
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("not run: %w", errLeaseLost)
	case err != nil:
		return 0, fmt.Errorf("record operation: %w", err)
	}
	return id, nil
}

// recordMany records tool calls of several runs (or several of one run) in one transaction,
// the ends they carry written with them, and returns each one's answer. When the shared
// statement fails for a reason that left nothing written (Postgres refused it), the calls are
// recorded one by one, so that a call Postgres refuses (its input, a lock held too long) fails
// alone. A connection lost meanwhile fails them all, as it would have failed each: a record
// whose answer was lost is never repeated (a write operation row may exist; its turn fails).
func (s *store) recordMany(ctx context.Context, reqs []recordReq) ([]recorded, error) {
	out := make([]recorded, len(reqs))
	if len(reqs) == 1 {
		out[0].id, out[0].err = s.recordOperation(ctx, reqs[0])
		return out, nil
	}
	err := s.recordAll(ctx, reqs, out)
	if err == nil {
		return out, nil
	}
	if transient(err) || ctx.Err() != nil {
		return nil, fmt.Errorf("record %d operations: %w", len(reqs), err)
	}
	apart(len(reqs), func(i int) { out[i].id, out[i].err = s.recordOperation(ctx, reqs[i]) })
	return out, nil
}

// recordAll runs recordOperationsSQL for reqs, after endOperationsSQL for the ends they carry,
// in one transaction, and fills out.
func (s *store) recordAll(ctx context.Context, reqs []recordReq, out []recorded) error {
	n := len(reqs)
	runs, convs, tools, effects := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	inputs, counts, order := make([]string, n), make([]int32, n), make([]int32, n)
	var rowIDs []int64
	var rowRuns, rowConvs []string
	var ends []opEnd
	byRun := map[string][]int{} // the calls of each run, in order
	for i, r := range reqs {
		runs[i], convs[i], tools[i], effects[i], inputs[i] = r.runID, r.conversationID, r.tool, string(r.effect), string(r.input)
		counts[i] = int32(len(r.ids)) //nolint:gosec // G115: a run holds at most MaxTurnMessages rows
		order[i] = int32(i)
		if _, seen := byRun[r.runID]; !seen {
			for _, id := range r.ids {
				rowIDs, rowRuns, rowConvs = append(rowIDs, id), append(rowRuns, r.runID), append(rowConvs, r.conversationID)
			}
		}
		byRun[r.runID] = append(byRun[r.runID], i)
		ends = append(ends, r.ends...)
	}
	batch := &pgx.Batch{}
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	if len(ends) > 0 {
		endIDs, statuses, outputs, errs, took := opEnds(ends)
		batch.Queue(endOperationsSQL, endIDs, statuses, outputs, errs, took)
	}
	ids := map[string][]int64{}
	batch.Queue(recordOperationsSQL, runs, convs, tools, effects, inputs, counts, order, rowIDs, rowRuns, rowConvs).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var run string
			var id int64
			if err := rows.Scan(&run, &id); err != nil {
				return err
			}
			ids[run] = append(ids[run], id)
		}
		return rows.Err()
	})
	if err := s.pool.SendBatch(ctx, batch).Close(); err != nil {
		return err
	}
	for run, calls := range byRun {
		got := ids[run]
		slices.Sort(got)
		for k, i := range calls {
			if len(got) != len(calls) {
				out[i].err = fmt.Errorf("not run: %w", errLeaseLost)
				continue
			}
			out[i].id = got[k]
		}
	}
	return nil
}

// endOperations writes ends, the ends of tool calls, in a transaction of their own. When
// Postgres refuses a value of theirs (see refused), each is written apart, and one refused on
// its own is written without its output, its error saying why (see unstored): every call's end
// is recorded, whatever its output.
func (s *store) endOperations(ctx context.Context, ends []opEnd) error {
	if len(ends) == 0 {
		return nil
	}
	err := s.writeEnds(ctx, ends)
	if refused(err) {
		err = nil
		for i := 0; i < len(ends) && err == nil; i++ {
			if err = s.writeEnds(ctx, ends[i:i+1]); refused(err) {
				err = s.writeEnds(ctx, []opEnd{unstored(ends[i], err)})
			}
		}
	}
	if err != nil {
		return fmt.Errorf("record the end of %d tool calls: %w", len(ends), err)
	}
	return nil
}

// writeEnds runs endOperationsSQL for ends, with lock_timeout: an operation row another
// transaction holds fails it instead of stalling it.
func (s *store) writeEnds(ctx context.Context, ends []opEnd) error {
	endIDs, statuses, outputs, errs, took := opEnds(ends)
	batch := &pgx.Batch{}
	batch.Queue(genericPlansSQL, s.lockTimeoutSetting())
	batch.Queue(endOperationsSQL, endIDs, statuses, outputs, errs, took)
	return s.pool.SendBatch(ctx, batch).Close()
}

// refused reports whether Postgres refused a statement for a value it carries rather than
// for the statement: a data exception (class 22: JSON jsonb cannot hold, such as a \u0000 or
// a lone surrogate escape or a number beyond numeric's range; text the database encoding
// cannot hold) or a program limit (class 54: a jsonb too large or nested too deep).
func refused(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "54"))
}

// unstored is end without the values Postgres refused (err): its output left out and its error
// saying so, with Postgres's message and code only: the detail and context quote the value at
// length (a message quotes at most the bytes of one character, of an output that would
// otherwise have been stored whole). The status stays: a call that returned is done, whether
// or not its output could be kept.
func unstored(end opEnd, err error) opEnd {
	why := "refused"
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		why = pgErr.Message + " (SQLSTATE " + pgErr.Code + ")"
	}
	end.output = nil
	end.errText = sanitize("output not stored: the database refused it: "+why, maxDetailBytes)
	return end
}

// history reads one turn's history (see historiesSQL).
func (s *store) history(ctx context.Context, r historyReq) ([]Message, error) {
	out := make([]histories, 1)
	if err := s.historyAll(ctx, []historyReq{r}, out); err != nil {
		return nil, fmt.Errorf("load history of %q: %w", r.conversationID, err)
	}
	return out[0].msgs, nil
}

// historyReq asks for up to limit messages of the history of run's turn in conversationID.
type historyReq struct {
	conversationID string
	runID          string
	limit          int
}

// histories answers a historyReq.
type histories struct {
	msgs []Message
	err  error
}

// historyMany reads the histories of several turns in one statement. When it fails, each is
// read on its own, so that a conversation whose messages cannot be read fails alone.
func (s *store) historyMany(ctx context.Context, reqs []historyReq) ([]histories, error) {
	out := make([]histories, len(reqs))
	if len(reqs) > 1 && s.historyAll(ctx, reqs, out) == nil {
		return out, nil
	}
	for i, r := range reqs {
		out[i] = histories{}
		out[i].msgs, out[i].err = s.history(ctx, r)
	}
	return out, nil
}

// historyAll runs historiesSQL for reqs and fills out.
func (s *store) historyAll(ctx context.Context, reqs []historyReq, out []histories) error {
	n := len(reqs)
	convs, runs, limits, order := make([]string, n), make([]string, n), make([]int32, n), make([]int32, n)
	for i, r := range reqs {
		if r.limit < 0 || r.limit > math.MaxInt32 {
			return fmt.Errorf("history limit %d", r.limit)
		}
		convs[i], runs[i], limits[i], order[i] = r.conversationID, r.runID, int32(r.limit), int32(i)
	}
	rows, err := s.pool.Query(ctx, historiesSQL, convs, runs, limits, order)
	if err != nil {
		return fmt.Errorf("load %d histories: %w", n, err)
	}
	defer rows.Close()
	for i := range out {
		out[i].msgs = []Message{}
	}
	for rows.Next() {
		var i int32
		var m Message
		if err := rows.Scan(&i, &m.ID, &m.Role, &m.Content, &m.CreatedAt); err != nil {
			return fmt.Errorf("load %d histories: %w", n, err)
		}
		out[i].msgs = append(out[i].msgs, m)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("load %d histories: %w", n, err)
	}
	return nil
}

// pendingConversation is a conversation with claimable rows, since its oldest was written.
type pendingConversation struct {
	conversationID string
	since          time.Time
}

// pendingConversations lists up to limit conversations whose oldest pending row is claimable
// (not backing off) and at least minAge old, oldest first. Busy conversations (a run holds
// rows of theirs) are left out: their claims would find nothing, and a page full of them
// would hide every other conversation from the polling source.
func (s *store) pendingConversations(ctx context.Context, minAge time.Duration, limit int) ([]pendingConversation, error) {
	rows, err := s.pool.Query(ctx, pendingConversationsSQL, minAge.Milliseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	convs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pendingConversation, error) {
		var p pendingConversation
		return p, r.Scan(&p.conversationID, &p.since)
	})
	if err != nil {
		return nil, fmt.Errorf("look for pending rows: %w", err)
	}
	return convs, nil
}

// oldestPending is the age of the oldest pending row (0 when none).
func (s *store) oldestPending(ctx context.Context) (time.Duration, error) {
	var age float64
	err := s.pool.QueryRow(ctx, oldestPendingSQL).Scan(&age)
	return time.Duration(age * float64(time.Second)), err
}

// rowState is the status of one outbox row, for resolving held events.
type rowState struct {
	status    string // "" when the row no longer exists
	available time.Time
}

// states reads the status and available_at of the outbox rows ids; a row missing from the map
// no longer exists (or is not visible yet).
func (s *store) states(ctx context.Context, ids []int64) (map[int64]rowState, error) {
	rows, err := s.pool.Query(ctx, statesSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox states: %w", err)
	}
	defer rows.Close()
	out := make(map[int64]rowState, len(ids))
	for rows.Next() {
		var id int64
		var st rowState
		if err := rows.Scan(&id, &st.status, &st.available); err != nil {
			return nil, fmt.Errorf("outbox states: %w", err)
		}
		out[id] = st
	}
	return out, rows.Err()
}
