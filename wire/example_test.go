package wire_test

import (
	"fmt"

	"github.com/batonhq/baton/wire"
)

func ExampleTurnSubject() {
	for _, id := range []string{"conv-42", "a.b", "*", "~abc"} {
		subj, err := wire.TurnSubject("agent", id)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(subj)
	}
	// Output:
	// agent.turns.conv-42
	// agent.turns.~YS5i
	// agent.turns.~Kg
	// agent.turns.~fmFiYw
}

func ExampleParseSubject() {
	kind, id, err := wire.ParseSubject("agent", "agent.outcomes.~YS5i")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s %q\n", kind, id)
	// Output: outcomes "a.b"
}

func ExampleStreamFilter() {
	fmt.Println(wire.StreamFilter("agent", wire.KindTurns))
	// Output: agent.turns.>
}
