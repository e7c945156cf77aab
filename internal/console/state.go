package console

import (
	"sort"
	"strconv"
	"time"
)

// The states a user message shows in the chat. The browser adds the first two: local (typed,
// not yet accepted by the server) and synchronized (the send returned). The server derives the
// others from the database only, never from elapsed time.
const (
	StateLocal        = "local"
	StateSynchronized = "synchronized"
	StateQueued       = "queued"
	StateRunning      = "running"
	StateReplied      = "replied"
	StateFailed       = "failed"
)

// genericFailure is what a failed message shows when its error message is missing (deleted, or a
// row ended in error without one). Internal error text (last_error, agent_runs.error) is never
// shown.
const genericFailure = "The request failed."

// MessageView is a user message as the chat shows it.
type MessageView struct {
	ID             string    `json:"id"`
	ConversationID string    `json:"conversation_id"`
	Content        string    `json:"content"`
	CreatedAt      time.Time `json:"created_at"`
	State          string    `json:"state"`

	OutboxID       *int64     `json:"outbox_id,omitempty"`
	Attempts       int        `json:"attempts"`
	AvailableAt    *time.Time `json:"available_at,omitempty"`
	RunID          string     `json:"run_id,omitempty"`
	Worker         string     `json:"worker,omitempty"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at,omitempty"`

	// Reply is the assistant's reply (state replied); Error the error message's text users see
	// (state failed).
	Reply string `json:"reply,omitempty"`
	Error string `json:"error,omitempty"`
}

// view derives what the chat shows of a message from its rows:
//
//   - no outbox row: synchronized (the message exists; the producer always writes both, so
//     this is only seen for messages written otherwise)
//   - pending: queued (also after a failed attempt, with attempts > 0, until available_at)
//   - processing: running, with the run, worker and lease that hold it
//   - done: replied, with the reply's text
//   - error: failed, with the error message's text (the generic text the worker stored)
func (m messageRow) view() MessageView {
	v := MessageView{ID: m.ID, ConversationID: m.ConversationID, Content: m.Content, CreatedAt: m.CreatedAt,
		OutboxID: m.OutboxID, AvailableAt: m.AvailableAt}
	if m.Attempts != nil {
		v.Attempts = *m.Attempts
	}
	status := ""
	if m.Status != nil {
		status = *m.Status
	}
	switch status {
	case "":
		v.State = StateSynchronized
	case "pending":
		v.State = StateQueued
	case "processing":
		v.State = StateRunning
		v.LeaseExpiresAt = m.LeaseExpiresAt
		if m.RunID != nil {
			v.RunID = *m.RunID
		}
		if m.Worker != nil {
			v.Worker = *m.Worker
		}
	case "done":
		v.State = StateReplied
		if m.ReplyContent != nil && m.ReplyRole != nil && *m.ReplyRole == "assistant" {
			v.Reply = *m.ReplyContent
		}
	default: // error, or anything a future version adds: not progress
		v.State = StateFailed
		v.Error = genericFailure
		if m.ReplyContent != nil && m.ReplyRole != nil && *m.ReplyRole == "error" {
			v.Error = *m.ReplyContent
		}
	}
	if v.State == StateReplied || v.State == StateFailed {
		v.AvailableAt = nil
	}
	return v
}

// views turns rows into views.
func views(rows []messageRow) []MessageView {
	out := make([]MessageView, len(rows))
	for i, r := range rows {
		out[i] = r.view()
	}
	return out
}

// changed returns the views of next that differ from what prev said of the same message (new
// ones included), and next indexed by id for the following call.
func changed(prev map[string]MessageView, next []MessageView) ([]MessageView, map[string]MessageView) {
	idx := make(map[string]MessageView, len(next))
	var diff []MessageView
	for _, v := range next {
		idx[v.ID] = v
		if old, ok := prev[v.ID]; !ok || !sameView(old, v) {
			diff = append(diff, v)
		}
	}
	return diff, idx
}

func sameView(a, b MessageView) bool {
	return a.State == b.State && a.Attempts == b.Attempts && a.RunID == b.RunID && a.Worker == b.Worker &&
		a.Reply == b.Reply && a.Error == b.Error && eqTime(a.LeaseExpiresAt, b.LeaseExpiresAt) &&
		eqTime(a.AvailableAt, b.AvailableAt) && eqInt(a.OutboxID, b.OutboxID) && a.Content == b.Content
}

func eqTime(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(*b)
}

func eqInt(a, b *int64) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// rowCache is what an event stream last read of its conversation: each message's row, with its
// contents, by id. A poll reads the rows without contents (messageVersionsSQL); a row whose
// message and reply rows are the versions cached still has the contents cached, and only the
// others are read with contents (messagesByIDSQL): new messages, a reply that appeared or
// changed, a message or reply row updated. The events are built from the completed rows as
// from a read of everything, so they are the same.
type rowCache map[string]messageRow

// newRowCache indexes rows read with their contents.
func newRowCache(rows []messageRow) rowCache {
	c := make(rowCache, len(rows))
	for _, r := range rows {
		c[r.ID] = r
	}
	return c
}

// missing returns the ids of the probed rows (read without contents) whose contents the cache
// does not hold, in their order.
func (c rowCache) missing(probed []messageRow) []string {
	var ids []string
	for _, p := range probed {
		if old, ok := c[p.ID]; !ok || !sameContents(old, p) {
			ids = append(ids, p.ID)
		}
	}
	return ids
}

// complete gives the probed rows their contents, in their order: from the cache when it holds
// them, else the row of read (read with contents by id after the probe, so possibly newer,
// and taken whole so that its state and its contents are of one moment). A probed row that is
// in neither was deleted after the probe and is left out. It returns the rows and the cache
// for the next poll.
func (c rowCache) complete(probed, read []messageRow) ([]messageRow, rowCache) {
	byID := make(map[string]messageRow, len(read))
	for _, r := range read {
		byID[r.ID] = r
	}
	rows := make([]messageRow, 0, len(probed))
	for _, p := range probed {
		if r, ok := byID[p.ID]; ok {
			rows = append(rows, r)
			continue
		}
		old, ok := c[p.ID]
		if !ok || !sameContents(old, p) {
			continue
		}
		p.Content, p.ReplyContent = old.Content, old.ReplyContent
		rows = append(rows, p)
	}
	return rows, newRowCache(rows)
}

// sameContents reports whether rows a and b have the same contents: the same version of the
// message row and the same reply at the same version. Contents are never compared, nor read
// to compare.
func sameContents(a, b messageRow) bool {
	return a.MessageVersion == b.MessageVersion && eqString(a.ReplyID, b.ReplyID) && eqUint32(a.ReplyVersion, b.ReplyVersion)
}

func eqString(a, b *string) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func eqUint32(a, b *uint32) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// TimelineEntry is one step of a message's journey. Kind is written, queued, claimed,
// operation, replied or failed.
type TimelineEntry struct {
	Kind   string    `json:"kind"`
	At     time.Time `json:"at"`
	Text   string    `json:"text"`
	RunID  string    `json:"run_id,omitempty"`
	Worker string    `json:"worker,omitempty"`
}

// finish fills the timeline's entries, in time order, and its state.
func (tl *Timeline) finish() {
	e := []TimelineEntry{{Kind: "written", At: tl.Message.CreatedAt,
		Text: "message " + tl.Message.ID + " written (role " + tl.Message.Role + ")"}}
	tl.State = StateSynchronized
	if o := tl.Outbox; o != nil {
		text := "outbox row " + itoa(o.ID) + " created; now " + o.Status + ", " + itoa(int64(o.Attempts)) +
			" attempt(s), available at " + o.AvailableAt.UTC().Format(time.RFC3339Nano)
		e = append(e, TimelineEntry{Kind: "queued", At: o.CreatedAt, Text: text})
		switch o.Status {
		case "pending":
			tl.State = StateQueued
		case "processing":
			tl.State = StateRunning
		case "done":
			tl.State = StateReplied
		default:
			tl.State = StateFailed
		}
	}
	for _, r := range tl.Runs {
		text := "claimed by run " + r.RunID + " on worker " + r.Worker
		if tl.Outbox != nil && tl.Outbox.RunID != nil && *tl.Outbox.RunID == r.RunID && tl.Outbox.LeaseExpiresAt != nil {
			text += ", lease until " + tl.Outbox.LeaseExpiresAt.UTC().Format(time.RFC3339Nano)
		}
		if r.Outcome != nil {
			text += "; ended " + *r.Outcome
		} else {
			text += "; running"
		}
		e = append(e, TimelineEntry{Kind: "claimed", At: r.StartedAt, Text: text, RunID: r.RunID, Worker: r.Worker})
	}
	for _, op := range tl.Ops {
		e = append(e, TimelineEntry{Kind: "operation", At: op.StartedAt, RunID: op.RunID,
			Text: "operation " + op.Tool + " (effect " + op.Effect + "): " + op.Status})
	}
	if rp := tl.Reply; rp != nil {
		kind, text := "replied", rp.Content
		if rp.Role != "assistant" {
			kind = "failed"
		}
		e = append(e, TimelineEntry{Kind: kind, At: rp.CreatedAt, Text: text})
	} else if tl.Outbox != nil && tl.Outbox.Status == "error" {
		at := tl.Outbox.CreatedAt
		if tl.Outbox.ProcessedAt != nil {
			at = *tl.Outbox.ProcessedAt
		}
		e = append(e, TimelineEntry{Kind: "failed", At: at, Text: genericFailure})
	}
	sort.SliceStable(e, func(i, j int) bool { return e[i].At.Before(e[j].At) })
	tl.Entries = e
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
