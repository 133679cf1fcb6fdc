"""Building, copying and naming ExportedPrograms; state lookup; torch's warnings and fx source caches."""
