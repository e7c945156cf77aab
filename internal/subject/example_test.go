package subject_test

import (
	"fmt"

	"github.com/batonhq/baton/internal/subject"
)

func ExampleTurns() {
	for _, id := range []string{"conv-42", "a.b", "*", "~abc"} {
		subj, err := subject.Turns("agent", id)
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

func ExampleParse() {
	kind, id, err := subject.Parse("agent", "agent.outcomes.~YS5i")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s %q\n", kind, id)
	// Output: outcomes "a.b"
}

func ExampleStreamFilter() {
	fmt.Println(subject.StreamFilter("agent", subject.KindTurns))
	// Output: agent.turns.>
}
